"""Where scenarios are kept: the Redis store of versions (:mod:`.store`; records decoded in :mod:`.records`, its
server-side scripts in :mod:`.scripts`, its errors in :mod:`.errors`), content-addressed bodies and chunks
(:mod:`.content`) and the embedded or external Redis server (:mod:`.redis_server`)."""
