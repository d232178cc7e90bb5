"""Synthetic RL tasks written as verl-schema parquet."""
