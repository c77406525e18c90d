"""Small helpers any layer may use, each one job: ranks and how a metric combines over them
(distributed), atomic file writes (files), host values onto the GPU without a host wait
(transfer), the one lazy loader of Triton kernel modules (kernels), library chatter kept
out of a run's output (quiet), the heartbeat line of a long phase (heartbeat), torch's CPU
thread count (threads), Ctrl-C as one line and exit 130 (interrupt), and the user's
file:line in an error raised by their own rule or reward (user_code)."""
