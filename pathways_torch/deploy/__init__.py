"""Running a Pathways cluster on the engines users have: Kubernetes (``jobset``)."""
