"""Moving bytes: opening memory handles, planning block copies, copy engines."""
