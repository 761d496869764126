"""What `agentfsm.mcp` is made of: its options and what a call's result becomes."""
