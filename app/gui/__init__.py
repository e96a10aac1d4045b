"""The desktop app: tray icon, dashboard, pairing dialog.

A thin client of the core: state is read through its feature services (held by `AppService`) and live updates
arrive through the event bus, turned into Qt signals by one bridge (`bridge.Bridge`).
"""
