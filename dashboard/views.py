from django.shortcuts import render

# Registers the Dash app with django-plotly-dash before its template tag looks it up.
from dashboard import telemetry_app
from dashboard.access import viewer_required


@viewer_required
def dashboard(request):
    return render(request, "dashboard/index.html", {"app_name": telemetry_app.APP_NAME})
