"""Generated from proto/ (make proto): the queue service's API, version 1."""
