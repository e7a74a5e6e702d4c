"""Hostile input: damaged model directories, hostile stores, requests and environments."""
