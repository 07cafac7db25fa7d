"""No models: roles are Django groups. The module exists because Django sends post_migrate only for
apps with a models module, and the role groups are synced from this app's post_migrate."""
