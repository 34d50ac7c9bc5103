"""The operator console: a web app for seeing and operating leasekeeper in a browser.

A CLIENT of the public gRPC API, like any other: it never reads the
database, so it works against any replica and every call obeys the
viewer's token and role (the service refuses; the console shows the
refusal). ``leasekeeper serve`` serves it beside the gRPC port
(``console_listen``, loopback by default); ``leasekeeper console --target``
runs it alone.

- ``app``: the Starlette app (routes, the session middleware, security
  headers, error pages); ``runtime``: the state of one console (service,
  sessions, hub); ``serving``: uvicorn in the caller's event loop, HTTPS,
  the loopback rule.
- ``pages``: namespaces, a namespace's tasks, one task, and ``/leases.json``
  (the shown tasks' remaining ttls, which the pages poll: renewals are not
  Watch events); ``actions``: revoke, cancel, retry with a reason and a
  confirmation, then a redirect to the result; ``signin``: sign-in and
  sign-out; ``events``: live updates (Server-Sent Events).
- ``service``: every call, through ``leasekeeper.LeaseClient`` with the
  viewer's token; ``hub``: one shared Watch stream per namespace;
  ``refresh``: the answers of ``/leases.json``, shared for 2 s among the
  viewers the service allowed the same read;
  ``sessions``: server-side sessions; ``csrf``: the checks of every POST;
  ``chart``: the fences-over-time SVG (pure); ``render``: templates
  (Jinja2, autoescape on), filters, URLs.
- ``templates/`` and ``static/`` ship in the package: no CDN, nothing
  fetched from elsewhere at run time.

Invariants: ids travel in query parameters, percent-encoded, and every
value a page shows is escaped; no token is ever put in a URL, a page or a
log line; every POST carries the session's CSRF token and this console's
Origin, or it changes nothing (403).
"""
