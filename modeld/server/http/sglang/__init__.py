"""The worker routes the SGLang model gateway reads: the load in its shapes (``answer.py``) and
the routes (``routes.py``). No ``request`` module: every route is a GET of the daemon's state."""
