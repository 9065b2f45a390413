"""Polygraphy comparisons of every backend against eager PyTorch, and accuracy-diff reports."""
