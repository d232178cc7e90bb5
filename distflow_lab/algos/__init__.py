"""Advantage estimators, losses and the built-in algorithms."""
