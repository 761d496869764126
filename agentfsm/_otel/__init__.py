"""The parts of `agentfsm.otel`: spans of loops, model requests and tool calls."""
