"""What `agentfsm.mcp` is made of: its options, a tool's arguments and what a
call's result becomes, the session held with a server (and how one that went
away is said), a stdio server's process, progress, resources, and the errors."""
