"""KV tiers below the device pool: host memory, then a storage tier shared by workers.

One KV connector (:mod:`.connector`) composes the parts: admission-time lookups, loads
and installs (:mod:`.admission`), what completed blocks are offered to the tiers and
when (:mod:`.offload`), the storage writes this worker queued (:mod:`.storage_writes`)
and their ``storage`` events (:mod:`.announcements`).
"""
