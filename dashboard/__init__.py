"""Operator dashboard: Plotly-Dash apps embedded in Django (django-plotly-dash), fed live over a websocket."""
