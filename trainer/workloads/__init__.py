"""Models and data the CLIs train, and the baselines they are compared with."""
