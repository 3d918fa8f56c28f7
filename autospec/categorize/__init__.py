"""Traffic categories and acceptance forecasts from prompt features."""
