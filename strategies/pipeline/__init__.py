"""Pipeline parallel: schedules as data (`schedules`), stage partitioning and the runner."""
