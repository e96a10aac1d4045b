"""The HTTP face of the core: an aiohttp application embedded in the app's event loop."""
