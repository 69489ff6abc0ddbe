"""The 'ascend' back-end: CANN's ``llm_datadist`` with the project's checks."""
