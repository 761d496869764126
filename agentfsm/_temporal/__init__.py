"""agentfsm on Temporal (the public side is `agentfsm.temporal`).

- `agent.py`: `TemporalAgent`, the registry the workflow reads, `local_activity`
- `wire.py`: what crosses Temporal's boundary, as JSON data
- `workflow.py`: `LoopWorkflow`, the activity provider, the tool wrapper
- `activities.py`: the inference, tool and handler activities, the context store
- `client.py`: `LoopClient`
"""
