"""The in-sandbox agent (`podgate agent`): port-forward from inside a VM-style sandbox by
dialing the target there and connecting back to the host. The API is `agent.proto`
(`python -m podgate.agent.generate` regenerates `agent_pb2`)."""
