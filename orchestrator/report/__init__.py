"""Results for people: terminal tables that fit, Markdown, CSV and JSON, and the HTML report with
its charts. Nothing here computes a statistic; it shows what `orchestrator.analysis` found.
Start with `html.py` (`build_report`, the report's sections) and `text.py` (a comparison as
text); `style.py` holds the one arm-to-colour map every chart uses."""
