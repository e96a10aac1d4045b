"""The core: the facade the GUI and the server use, and the rules they share. No Qt, no aiohttp."""
