"""distflow_lab: multi-controller RL post-training, Jupyter-first."""
