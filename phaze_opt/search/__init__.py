"""The outer search: evaluate one design, the Optuna study, the exhaustive sweep, MLflow logging."""
