"""The live page and the request records (blueprint 0022): the page's state as JSON
(``answer.py``) and the routes (``routes.py``), with the page itself beside them (``page.html``,
``page.js``, ``page.css``: no build step). No ``request`` module: every route is a GET."""
