"""Tuning on logged traffic: trace replay and Optuna studies over policy parameters."""
