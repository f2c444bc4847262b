"""Authentication and least-privilege authorization: principals, the ACL plan, credentials.

`principals` names who there is; `kafka_acls` and `redis_acls` say, as pure functions of the
catalog and the deployment, what each principal may touch; `plan` puts them together with the
topics to create; `credentials` reads a process's login and keeps generated passwords; `apply`
is the only module here that talks to Kafka and Redis.
"""

__all__: list[str] = []
