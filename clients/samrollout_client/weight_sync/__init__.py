"""New policy weights from the trainer to every server: the files a push sends (`weight_files`), staged over HTTP
and relayed along chains (`weight_push`), loaded everywhere or rolled back (`weight_commit`), and the versions the
servers serve, in the order the client saw them (`versions`).  What travels on the wire is
`samrollout_client.protocol.weight_uploads`.
"""
