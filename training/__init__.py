"""Data preparation, training, evaluation, MLflow tracking, traces, benchmarks and the simulator driver."""
