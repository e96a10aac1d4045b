"""The few colours the app sets itself (everything else follows the platform's style)."""

HINT = "color: #6b7280"     # secondary text: hints under fields, notes under tables
ERROR = "color: #b91c1c"    # a refused value, next to its field
