"""The FastAPI controller: jobs, best configs, presets, workers, auth and the dashboard (`create_app`)."""
