"""Files the app reads at run time (package data): the OpenAPI document, the tray and app icons,
the autostart template. Read them through app.paths.resource(), never by a path beside the source."""
