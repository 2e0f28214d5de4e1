"""The directory service: membership with leases, the dataset registry and job records."""
