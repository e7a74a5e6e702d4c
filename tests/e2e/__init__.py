"""Whole-product flows: the README, real model families, examples, docs and the distribution."""
