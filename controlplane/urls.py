from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("controlplane.api.urls")),
    path("", include("dashboard.urls")),
    # The gateway runs without a separate static file server or collectstatic: the dashboard's Dash
    # scripts and the admin's assets are looked up by the staticfiles finders and served from here.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
    path("", include("controlplane.gateway.urls")),
]
