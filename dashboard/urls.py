from django.contrib.auth import views as auth_views
from django.urls import include, path

from dashboard import controls, views

urlpatterns = [
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("dashboard/", views.dashboard, name="dashboard"),
    path("dashboard/pools/<int:pool_id>/scale/", controls.pool_scale, name="dashboard-pool-scale"),
    path("dashboard/pools/<int:pool_id>/autoscale/", controls.pool_autoscale, name="dashboard-pool-autoscale"),
    path("dashboard/instances/<int:instance_id>/drain/", controls.instance_drain, name="dashboard-instance-drain"),
    path("dashboard/instances/<int:instance_id>/resume/", controls.instance_resume, name="dashboard-instance-resume"),
    path("django_plotly_dash/", include("django_plotly_dash.urls")),
]
