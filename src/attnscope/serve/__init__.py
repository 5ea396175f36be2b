"""The explorer: a local web app (``attnscope serve``) that brings capture, views, pattern
classification, statistics and interventions together on one page, plus the JSON API it uses.

``service`` computes (plain functions of a loaded model), ``pool`` keeps models warm, ``app``
is the FastAPI app; the ``attnscope serve`` command is :mod:`attnscope.cli.serve`.
"""
