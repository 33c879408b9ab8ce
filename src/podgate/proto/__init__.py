"""Sans-IO protocol cores: bytes in, events out. No asyncio, socket, threading or subprocess."""
