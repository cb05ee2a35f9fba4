"""``stepskip view`` (a local, read-only web app) and ``stepskip report`` (one self-contained HTML file).

:mod:`stepskip.view.data` reads a cache through the cache index into JSON-ready views,
:mod:`stepskip.view.server` serves them with the page in ``static/``, :mod:`stepskip.view.report`
inlines them into one file. The charts are drawn by Chart.js (MIT, vendored as
``static/chart.umd.min.js``; see ``static/chart.js-LICENSE.md``).
"""
