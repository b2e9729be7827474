{application, fedgate_mqtt_auth, [
    {description, "fedgate: an MQTT device connects with its own client id only"},
    {vsn, "1.0.0"},
    {modules, [fedgate_mqtt_auth]},
    {registered, []},
    {applications, [kernel, stdlib, rabbit_common, rabbit]},
    {env, []}
]}.
