"""Replay and fork: re-driving a loop from what its events recorded (see `agentfsm.replay`)."""
