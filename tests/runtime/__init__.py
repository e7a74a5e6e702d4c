"""Loading and calling exported models: verdicts, routes, buckets, devices (runtime)."""
