"""nvme."""
