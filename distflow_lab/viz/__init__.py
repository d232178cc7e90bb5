"""Figures and widgets. They take a session or DataFrames and never import `lab`."""
