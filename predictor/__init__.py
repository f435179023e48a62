"""Output-length prediction: prompt -> a distribution of output length. Never imports mlflow."""
