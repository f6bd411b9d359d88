"""Pipeline parallelism: schedules as pure task lists (`tasks`, `schedules`, `simulate`) and their runtime."""
