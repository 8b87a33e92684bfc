"""Workers: the Worker gRPC service over an engine backend (sim or vLLM), and the status agent."""
