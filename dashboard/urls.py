from django.contrib.auth import views as auth_views
from django.urls import include, path

from dashboard import views

urlpatterns = [
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("dashboard/", views.dashboard, name="dashboard"),
    path("django_plotly_dash/", include("django_plotly_dash.urls")),
]
