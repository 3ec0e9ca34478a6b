"""Who is in a job: registered ranks and their leases, the membership epochs (joins and leaves), the enrolment
that carries them out, and the async data cursor."""
