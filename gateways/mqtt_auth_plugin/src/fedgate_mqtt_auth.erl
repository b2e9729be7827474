%% fedgate's authentication backend for gateway nodes: RabbitMQ's internal
%% users, and an MQTT device may connect with its own client id only.
%%
%% Why: RabbitMQ's MQTT plugin disconnects the connection that holds a client
%% id as soon as another one logs in with it, before any queue or topic
%% permission is checked (rabbit_mqtt_processor: login, vhost access, then
%% register_client_id).  Without this check a registered device that sends
%% another device's id knocks that device off, again and again.  RabbitMQ
%% 4.0 has no setting for it; the MQTT plugin hands the client id to the
%% authentication backends, so the check belongs here, at login.
%%
%% A user without tags is a device (fedgate's device users have none): its
%% client id must equal its user name.  Users with tags (fedgate's
%% administrator, operators' tools) may use any client id.  Logins without a
%% client id (AMQP, the management API, the CLI) are the internal backend's.
%%
%% Configured as the only authentication backend of a gateway
%% (gateways/templates/rabbitmq.conf); never chain `internal` after it, since
%% a refused login would be tried again there and succeed.
-module(fedgate_mqtt_auth).
-behaviour(rabbit_authn_backend).

-include_lib("rabbit_common/include/rabbit.hrl").

-export([description/0, user_login_authentication/2]).

description() ->
    [{name, <<"fedgate_mqtt_auth">>},
     {description, <<"Internal users; an MQTT device connects with its own client id only">>}].

user_login_authentication(Username, AuthProps) ->
    case rabbit_auth_backend_internal:user_login_authentication(Username, AuthProps) of
        {ok, User} -> own_client_id(User, proplists:get_value(client_id, AuthProps));
        Refused -> Refused
    end.

own_client_id(User, undefined) ->
    {ok, User};
own_client_id(User = #auth_user{username = Username}, Username) ->
    {ok, User};
own_client_id(User = #auth_user{tags = [_ | _]}, _ClientId) ->
    {ok, User};
own_client_id(#auth_user{username = Username}, ClientId) ->
    {refused, "MQTT client id '~ts' is not device '~ts''s own: a device connects with its own id",
     [ClientId, Username]}.
