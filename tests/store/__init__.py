"""Models logged to and loaded from real MLflow servers and artifact stores (store)."""
